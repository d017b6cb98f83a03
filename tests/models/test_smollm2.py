"""SmolLM2-135M-Instruct, a real trained Llama (tests/smollm2.py), in the engine on the CPU in
float32 answers chat prompts token for token as transformers' greedy generate() does, EOS
included, through plain batching and through chunked prefill, preemption and the prefix cache."""
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_TOKENS = 32
# The engine's float32 logits differ from transformers' by up to about 7e-5 on this model (30
# layers, logits up to 40); a reference token ahead by less than this could flip.
MIN_LOGIT_GAP = 1e-3
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "List three prime numbers."}],
    [{"role": "user", "content": "Explain gravity to a child in two sentences."}],
    [{"role": "user", "content": "How many legs does a spider have?"}],
    [{"role": "user", "content": "Write a Python function that adds two numbers."}],
    [{"role": "system", "content": "You are a pirate. Answer like one."},
     {"role": "user", "content": "Where did you hide the treasure?"}],
    [{"role": "user", "content": "Hi, my name is Sam."},
     {"role": "assistant", "content": "Hello Sam! How can I help you today?"},
     {"role": "user", "content": "What is my name?"}],
]
# Prompts of 30 to 63 tokens: 32-token steps prefill most of them in chunks. The chat template's
# default system prompt puts the same 3 blocks of 8 in front of all prompts but one, which the
# prefix cache shares; 40 blocks hold the prompts but not the answers, so sequences are
# preempted as they grow.
MIXED_ENGINE = dict(max_model_len=128, kvcache_block_size=8, num_kvcache_blocks=40, max_num_batched_tokens=32,
                    max_num_seqs=8)


@pytest.fixture(scope="module")
def tokenizer(smollm2_checkpoint):
    return AutoTokenizer.from_pretrained(smollm2_checkpoint)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) for chat in CHATS]


@pytest.fixture(scope="module")
@torch.inference_mode()
def expected(smollm2_checkpoint, tokenizer, prompts):
    """transformers' greedy generate() of every prompt, each cut after its first EOS as the
    engine stops there. One left-padded batch: padding changes float32 rounding only, which
    MIN_LOGIT_GAP covers as it covers the engine's."""
    model = AutoModelForCausalLM.from_pretrained(smollm2_checkpoint, dtype=torch.float32).eval()
    batch = tokenizer(prompts, padding=True, padding_side="left", return_tensors="pt")
    out = model.generate(**batch, max_new_tokens=MAX_TOKENS, do_sample=False, output_logits=True,
                         return_dict_in_generate=True)
    outputs = []
    for row, (tokens, logits) in enumerate(zip(out.sequences[:, batch.input_ids.shape[1]:].tolist(),
                                               torch.stack(out.logits, dim=1))):
        length = tokens.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in tokens else len(tokens)
        top2 = logits[:length].topk(2).values
        gaps = top2[:, 0] - top2[:, 1]
        assert gaps.min() > MIN_LOGIT_GAP, f"reference near-tie for prompt {row} at step {int(gaps.argmin())}"
        outputs.append(tokens[:length])
    return outputs


def generate_greedy(llm, prompts):
    from nanovllm import SamplingParams
    return llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)


def assert_outputs_match(outs, expected, tokenizer):
    assert [o["token_ids"] for o in outs] == expected
    eos = tokenizer.eos_token_id
    assert [o["finish_reason"] for o in outs] == ["stop" if ids[-1] == eos else "length" for ids in expected]
    assert [o["text"] for o in outs] == [tokenizer.decode(ids, skip_special_tokens=True) for ids in expected]


def test_checkpoint_tokenizer_is_smollm2s(smollm2_checkpoint, tokenizer):
    """The tokenizer saved from the GGUF file renders SmolLM2's chat template, ends turns with
    <|im_end|> (the engine's EOS) and splits numbers digit by digit as SmolLM2 does."""
    from nanovllm.models import model_config_from_dir
    rendered = tokenizer.apply_chat_template(CHATS[0], tokenize=False, add_generation_prompt=True)
    assert rendered == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                        "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                        "<|im_start|>assistant\n")
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.bos_token == "<|im_start|>"
    assert model_config_from_dir(str(smollm2_checkpoint)).eos_token_id == [tokenizer.eos_token_id]
    assert tokenizer.tokenize("In 2024") == ["In", "Ġ", "2", "0", "2", "4"]
    assert tokenizer.decode(tokenizer.encode("Hi , Sam 's")) == "Hi , Sam 's"


def test_chat_batch_matches_transformers_generate(smollm2_checkpoint, new_llm, prompts, expected, tokenizer):
    outs = generate_greedy(new_llm(smollm2_checkpoint), prompts)
    assert_outputs_match(outs, expected, tokenizer)
    # Guards the prompts: some answers end by EOS within MAX_TOKENS, some do not.
    assert {o["finish_reason"] for o in outs} == {"stop", "length"}


def test_chat_through_chunked_prefill_preemption_and_prefix_cache(smollm2_checkpoint, new_llm, prompts,
                                                                   expected, tokenizer):
    llm = new_llm(smollm2_checkpoint, **MIXED_ENGINE)
    assert_outputs_match(generate_greedy(llm, prompts), expected, tokenizer)
    stats = llm.memory_stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_blocks"] > 0


def test_gguf_file_answers_as_transformers_on_its_dequantized_weights(smollm2_checkpoint, new_llm, prompts,
                                                                      expected, tokenizer):
    """The GGUF file itself (Q4_1 and Q8_0 blocks, Llama's interleaved q/k rows, tokenizer and
    chat template inside) in the engine: the same chat prompt text and answers."""
    import smollm2
    llm = new_llm(smollm2.gguf_file())
    assert [llm.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            for chat in CHATS] == prompts
    assert llm.tokenizer.eos_token == smollm2.EOS_TOKEN
    assert_outputs_match(generate_greedy(llm, prompts), expected, tokenizer)
