"""The application on top of the library: the ``harts-hf`` command (``cli.py``; ``train.py`` for
``harts-hf train``), the recipe scripts' machinery (``recipe/``), the console and progress lines,
and ``train-compare`` (HARTS beside stock TRL). Nothing in the library imports it."""
