"""The host-side engine of one replica: scheduler, KV block manager, executor choice, the offline `LLM`,
the asyncio driver, and the prefill/decode replica logic of disaggregated serving."""
from engine.llm import LLM
from engine.llm_engine import LLMEngine, RequestOutput
from workers.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "RequestOutput", "SamplingParams"]
