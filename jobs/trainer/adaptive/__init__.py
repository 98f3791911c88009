"""Adaptive evaluation under a GPU budget (``--eval-adaptive``): ``policy`` decides which steps are still open,
``spend`` grants them more samples within the budget (docs/USER_GUIDE.md "Adaptive evaluation")."""

from ckpteval.coord.faces import face

__all__, __getattr__ = face(__name__, {"AdaptiveSettings": "policy", "parse_adaptive": "policy",
                                       "open_steps": "policy", "AdaptiveSpender": "spend"})
