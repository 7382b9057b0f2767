"""Errors raised while reading a model file; each message names the file and the problem."""


class ModelFormatError(ValueError):
    """A model file that cannot be served: not GGUF, truncated, wrong architecture, bad tensor, bad metadata."""

    def __init__(self, path, problem: str):
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")
