"""The pooling runner: encoder models (BERT, RoBERTa, XLM-R, ModernBERT) for embeddings, classification
and cross-encoder scores, batched by a token budget without padding; decoder embedding models
(last-token pooling) on the paged engine (``decoder.py``). ``make_pooling_engine`` picks.

    engine = PoolingEngine(EngineArgs(model="path/to/st-folder", runner="pooling"))
    engine.add_request("0", engine.tokenize("some text")[0], PoolingParams(task="embed"))
    engine.step()[0].outputs.embedding
"""

from vpage.pooling.engine import PoolingEngine, make_pooling_engine
from vpage.pooling.loader import pooling_architectures, resolve_runner
from vpage.pooling.pooler import cosine_similarity
from vpage.pooling.st_config import PoolerConfig

__all__ = ["PoolerConfig", "PoolingEngine", "cosine_similarity", "make_pooling_engine", "pooling_architectures",
           "resolve_runner"]
