"""A user policy loss for tests, named 'losses_for_tests:scaled' (a user's 'package.module:function')."""

from postrl.algorithms import Param, declare_policy_loss, policy_loss


@declare_policy_loss(params={"scale": Param(1.0, "Multiplies the vanilla clipped loss.", gt=0.0, le=10.0)})
def scaled(logp_BT, old_logp_BT, adv_BT, mask_BT, *, scale: float, **clip):
    """The vanilla loss times `scale`: its loss and gradient are `scale` times vanilla's, which proves the value arrived."""
    loss_BT, stats = policy_loss(logp_BT, old_logp_BT, adv_BT, mask_BT, **clip)
    return scale * loss_BT, stats


def undeclared(logp_BT, old_logp_BT, adv_BT, mask_BT, **clip):
    """A plain function: it declares no arguments and no preferred defaults."""
    return policy_loss(logp_BT, old_logp_BT, adv_BT, mask_BT, **clip)


NOT_A_FUNCTION = 3
