"""Cross-validation tooling, above both backends: the ``qsa`` command (``cli``), the differential
runner behind ``qsa check`` (``crosscheck``), AOT compile checks (``compile``), capture/replay of
kernel calls (``capture``) and the loader of upstream SGLang's kernels as a peer (``peer``).

The core (``interop/*.py``) never imports this package; these modules import ``qsa_triton`` /
``qsa_pallas`` (and torch / jax) lazily, inside the functions that need them.
"""
