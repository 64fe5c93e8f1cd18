"""A verl reward file, written as verl's docs show (docs/preparation/reward_function.rst): postrl's tests run it
unchanged through `custom_reward_function.path` / `.name`."""

import os
import time


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """GSM8K-style: the text after the last '####' is the answer; a dict with "score" and more values."""
    if data_source == "slow":
        time.sleep(30)  # past any reward.timeout_s the tests set
    answer = solution_str.split("####")[-1].strip()
    correct = answer == str(ground_truth)
    seen = isinstance(extra_info, dict) and "num_turns" in extra_info and "rollout_reward_scores" in extra_info
    return {
        "score": 1.0 if correct else 0.0,
        "acc": correct,
        "pred": answer,  # a string: kept by verl in reward_extra_info, not a metric in postrl
        "pid": os.getpid(),
        "index_seen": float(extra_info["index"]) if seen else -1.0,
        "truth_is_list": float(isinstance(ground_truth, list)),
    }


def length_score(data_source, solution_str, ground_truth, extra_info=None):
    """A bare float, as verl's simplest example."""
    return len(solution_str) / 100


def scaled_score(data_source, solution_str, ground_truth, extra_info=None, scale=1.0, format_bonus=None):
    """Extra keywords bound from custom_reward_function.reward_kwargs (verl passes them with functools.partial)."""
    correct = solution_str.split("####")[-1].strip() == str(ground_truth)
    bonus = format_bonus["value"] if format_bonus and "####" in solution_str else 0.0
    return scale * float(correct) + bonus
