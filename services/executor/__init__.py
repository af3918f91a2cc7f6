"""The executor: KV pools, the model, the sampler; applies one plan per step and returns tokens."""
