"""Generate from a Hugging Face checkpoint folder of a supported family (docs/usage.md):
    python example.py /path/to/Qwen3-0.6B
Without a folder it runs the packaged Qwen3-0.6B architecture with random weights on token ids,
which shows the engine working but produces meaningless tokens."""
import os
import sys

from nanovllm import LLM, SamplingParams


def main():
    if len(sys.argv) > 1:
        llm = LLM(sys.argv[1])
        prompts = ["Introduce yourself in one sentence.", "List the first ten prime numbers."]
    else:
        config_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "nanovllm", "configs", "qwen3-0.6b")
        llm = LLM(config_dir, load_format="dummy", max_model_len=1024, max_num_seqs=16)
        prompts = [[151644, 872, 198, 9707], [151644, 872, 198, 2610, 525]]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.6, top_p=0.95, max_tokens=64))
    for prompt, output in zip(prompts, outputs):
        print(f"prompt: {prompt!r}\ncompletion: {output['text']!r}\ntoken ids: {output['token_ids'][:16]}...\n")


if __name__ == "__main__":
    main()
