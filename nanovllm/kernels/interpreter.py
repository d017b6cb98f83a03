"""Whether Triton runs its kernels through the interpreter (TRITON_INTERPRET=1), read once at
import as Triton itself does. The launchers that launch differently there read it from here, and
dispatch.py, which routes ops to them, too: no launcher imports the router."""
import os

INTERPRETER = os.environ.get("TRITON_INTERPRET", "0") == "1"
