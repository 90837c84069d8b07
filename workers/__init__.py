"""One replica's inference engine: models, paged KV cache, scheduler, model runner, sampler."""
from workers.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from workers.engine import LLMEngine, RequestOutput
from workers.llm import LLM
from workers.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "RequestOutput", "SamplingParams", "EngineConfig", "ModelConfig", "ParallelConfig",
           "CacheConfig", "SchedulerConfig"]
