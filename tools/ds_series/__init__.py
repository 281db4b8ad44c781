"""The patch series' tooling: the stack of PRs (``stack``), the ``pip install .`` build backend, the series lint,
upstream's tests against pristine (``upstream_tests``), the hunk check and the JIT op pre-build.

Works on a checkout: the package is installed editable from its ``tools/`` folder, and finds ``patches/`` there.
"""
