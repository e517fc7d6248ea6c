# A script as users write them: no `if __name__ == "__main__":` guard. Run as
#   python guardless_parallel.py MODEL
# it prints one JSON line: the greedy token ids of one process, then of -tp 2 and -pp 2,
# and how each executor's workers were started. A first engine runs a forward pass on two
# OpenMP threads in this process before the others start their workers, and a thread keeps
# running matmuls while they start (run it with two threads per worker too).
import json
import sys
import threading

import torch

from pagedllm import LLM, SamplingParams

torch.set_num_threads(2)

KWARGS = dict(dtype="float32", max_model_len=128, block_size=8, num_gpu_blocks_override=32)
PROMPTS = [{"prompt_token_ids": p} for p in ([5, 9, 33, 100, 7, 250, 3, 18], [40, 41, 42], [700])]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
stop = threading.Event()


def busy() -> None:
    a = torch.randn(256, 256)
    while not stop.is_set():
        a = torch.tanh(a @ a)


def tokens(llm: LLM) -> list:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


result = {"tp1": tokens(LLM(sys.argv[1], **KWARGS))}
thread = threading.Thread(target=busy, daemon=True)
thread.start()
for name, sizes in (("tp2", dict(tensor_parallel_size=2)), ("pp2", dict(pipeline_parallel_size=2))):
    llm = LLM(sys.argv[1], **sizes, **KWARGS)
    executor = llm.llm_engine.engine_core.model_executor
    result[name] = tokens(llm)
    result[name + "_start_method"] = executor.start_method
    if name == "tp2":
        llm.llm_engine.engine_core.shutdown()
# NOTE: the PP=2 engine is left running, as scripts do: exiting must still stop its workers.
stop.set()
thread.join()
print(json.dumps(result))
