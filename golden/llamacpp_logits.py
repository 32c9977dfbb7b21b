"""llama.cpp's logits for every position of one token sequence: the peer reference.

    python golden/llamacpp_logits.py FILE.gguf OUT.npy ID [ID ...]

One model per process (llama.cpp keeps global state), CPU only, and without llama.cpp's extra
buffer types: their weight repacking crashes on these tiny MLA files on AMX machines.
"""

import os
import sys

import numpy as np
import llama_cpp
from llama_cpp import llama_cpp as lib


def params_without_repacking():
    params = default_params()
    params.use_extra_bufts = False
    return params


default_params = lib.llama_model_default_params
lib.llama_model_default_params = params_without_repacking


def main() -> None:
    path, out, *ids = sys.argv[1:]
    ids = [int(i) for i in ids]
    llm = llama_cpp.Llama(
        model_path=path,
        n_gpu_layers=0,
        n_ctx=max(64, len(ids)),
        n_batch=len(ids),
        n_ubatch=len(ids),
        n_threads=1,
        n_threads_batch=1,
        logits_all=True,
        verbose=True,  # on failure, llama.cpp says why only in its log
    )
    llm.eval(ids)
    np.save(out, np.asarray(llm.scores[: len(ids)], dtype=np.float32))
    # Skip llama.cpp's teardown: once in a fresh-clone run it crashed after the logits were
    # saved (last log line from ~llama_context), which made the run report a failure.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
