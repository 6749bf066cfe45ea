"""HuggingFace causal LMs evaluated like posbench's own models (``model: {hf: NAME}``):
``loader`` (the folder or hub id under the operator's rules, the model and its tokenizer),
``model`` (the adapter the evaluation reads, RoPE scalings set on its config), ``tokens``
(the corpus in the model's tokens, with the bytes each covers), ``answers`` (the
synthetic tasks' examples in the model's tokens) and ``run`` (one run: evaluate, probe,
record)."""
