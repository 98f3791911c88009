"""Scorers ``judge`` (an LLM judge behind an OpenAI-compatible chat endpoint) and ``reward_model``: the
scorer, its settings and verdict rule, and the HTTP side. Guide: docs/USER_GUIDE.md "Judges and reward models"."""

from ckpteval.coord.faces import face

__all__, __getattr__ = face(__name__, {"JudgeScorer": "scorer", "RewardModelScorer": "scorer", "JudgeOptions": "rule"})
