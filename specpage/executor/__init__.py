"""The executor side of the step: StepBatch in, StepResult out. The model
runners (one per model, KV tensors indexed by the pool's block ids), the
head runner, the executor that runs proposers and the verifier over them,
and its tensor-parallel form."""
