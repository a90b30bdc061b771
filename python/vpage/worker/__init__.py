"""One rank's work: the worker (model shard and KV cache), the model runner, the cache engine,
CUDA decode graphs and input staging. Workers import only the config and the layers below."""
