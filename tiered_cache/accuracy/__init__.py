"""State accuracy on trained models (issue 24): tiny hybrids trained on multi-query associative recall
(``recall``: the task, the models, their committed weights; ``train``: how they were trained), the
state codecs measured on them (``codecs``) and the measurements through the tiers (``measure``).

Needs the ``engine`` extra (``transformers``) and ``safetensors``; imported by nothing else in the package.
"""
