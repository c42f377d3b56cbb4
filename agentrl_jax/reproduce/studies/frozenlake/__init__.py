"""FrozenLake's study: the Q* demonstrator, the tokenizer corpus, R_single from exact Q*, and
the step diagnostics on FrozenLake states."""

from agentrl_jax.reproduce.studies.frozenlake.study import (
    FrozenLakeStudy,
    QStarDemonstrator,
    frozenlake_corpus,
)

__all__ = ["FrozenLakeStudy", "QStarDemonstrator", "frozenlake_corpus"]
