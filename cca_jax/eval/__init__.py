"""Evaluation: long-document perplexity, passkey / needle retrieval, multi-document QA.

The CLI is `python -m cca_jax.eval {ppl,passkey,mdqa}` (`__main__.py`); each task is one
module with a Python API (`ppl.perplexity`, `passkey.make_sample` / `passkey.evaluate`,
`mdqa.qa_prompt` / `mdqa.best_subspan_em`) and `plots.py` draws the results.
"""
