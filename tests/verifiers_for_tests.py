"""User verifiers for tests, named as 'verifiers_for_tests:<fn>' (a user's 'package.module:function')."""


def length_parity(completion: str, ground_truth: str, row: dict) -> dict:
    """1 for an even number of characters: about half the samples of a random model, so groups are mixed
    and some (all-even or all-odd) are filtered by dynamic sampling."""
    ok = float(len(completion) % 2 == 0)
    return {"score": ok, "acc": ok}


def never(completion: str, ground_truth: str, row: dict) -> float:
    return 0.0


def vowel_share(completion: str, ground_truth: str, row: dict) -> dict:
    """A dense reward the policy can learn fast: the share of vowels among the characters."""
    letters = [c for c in completion.lower() if c.isalpha()]
    share = sum(c in "aeiou" for c in letters) / max(len(letters), 1)
    return {"score": share, "acc": float(share > 0.5)}


def parity_unless_multiple_of_three(completion: str, ground_truth: str, row: dict) -> dict:
    """length_parity, but 0 for every completion of a problem whose answer is a multiple of 3: about a
    third of the groups are uniform whatever the model does, so dynamic sampling refills almost every step."""
    if int(ground_truth) % 3 == 0:
        return {"score": 0.0, "acc": 0.0}
    return length_parity(completion, ground_truth, row)


# Verifiers that fail, for the reliability catalogue (tests/test_catalogue.py). `flaky` fails in the
# way its completion names, so one batch can hold every kind of failure next to good calls.
def sleeps(completion: str, ground_truth: str, row: dict) -> float:
    """Always runs past any test's reward.timeout_s."""
    import time

    time.sleep(60)
    return 1.0


def raises(completion: str, ground_truth: str, row: dict) -> float:
    raise ValueError(f"cannot parse {completion!r}")


def returns_nan(completion: str, ground_truth: str, row: dict) -> float:
    return float("nan")


def returns_text(completion: str, ground_truth: str, row: dict) -> str:
    return "correct"


def flaky(completion: str, ground_truth: str, row: dict):
    """'sleep' -> times out, 'raise' -> raises, 'nan' / 'text' -> invalid, anything else -> 1.0."""
    return {"sleep": sleeps, "raise": raises, "nan": returns_nan, "text": returns_text}.get(
        completion, lambda *_: 1.0
    )(completion, ground_truth, row)
