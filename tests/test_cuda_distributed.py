"""The distributed path on one GPU (skipped without one): the "mp" executor at world size 1 starts a
worker process that joins torch.distributed on NCCL and runs every collective through the CUDA
platform's NcclCommunicator; its float32 greedy tokens and logprobs equal the in-process ("uni") run's.

On a one-GPU machine: `python -m pytest tests/test_cuda_distributed.py -v`.
"""

from __future__ import annotations

import pytest
import torch

from keel.config import EngineArgs
from keel.engine.llm_engine import LLMEngine
from keel.testing.checkpoints import make_checkpoint
from keel.testing.distributed import assert_same_as_reference, run_stress, stress_prompts

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]
ARGS = {"skip_tokenizer_init": True, "dtype": "float32", "block_size": 16, "max_model_len": 64, "seed": 0,
        "max_num_batched_tokens": 16, "num_kv_blocks": 12, "plugins": ["platform-cuda", "attention-flash",
        "models-llama"], "platform": "cuda", "gpu_memory_utilization": 0.3}


def _run(path, **kw):
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(path), **ARGS, **kw))
    try:
        info = engine.core.executor.collective_rpc("distributed_info")
        results, _ = run_stress(engine, stress_prompts(300))
    finally:
        engine.shutdown()
    return info, results


def test_mp_executor_on_one_gpu_goes_through_nccl(tmp_path):
    path = make_checkpoint("llama", tmp_path / "llama", head_dim=64)
    # The worker process first: the in-process run afterwards cannot leave memory in its way.
    info, results = _run(path, distributed_executor_backend="mp")
    assert info == [{"backend": "nccl", "tp_group": "GroupCoordinator(tp, ranks=[0], rank_in_group=0)",
                     "device_communicator": "NcclCommunicator", "tp_all_reduce": 1.0}]
    _, reference = _run(path, distributed_executor_backend="uni")
    assert_same_as_reference(results, reference)
