"""Latent attention (`convert-gqa --to mla`): the grouped model's layers written as transformers' stock
`DeepseekV3ForCausalLM` (`gqakit.hf.architectures.latent` holds the target's table). `construct.py` is the tensor
maths of one layer, `ops.py` the plan's output tensors."""
