"""Running a model for the engine: the scheduler decides what runs, these modules run it.

``forward``: one request's prefill on its ``transformers`` cache (``forward_chunk``) and a batched
decode step over several (``decode_batch``). ``split_forward``: a prefill forward that also takes the
recurrent state inside it. ``graph_decode`` / ``graph_prefill``: decode steps and prefill's chunk rule
on static buffers, replayed as CUDA graphs on a GPU. ``model_runner.ModelRunner``: which of these an
engine's forwards take, decided once from its config and the model.
"""
