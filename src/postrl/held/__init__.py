"""The models a run holds beside the policy, each built once by the assembly (assembly.py):

- reference.py: the frozen KL reference (a copy, checkpoint.ref_model_path, or the LoRA base), made ready for
  its log-prob pass; `frozen` holds any such model (the teacher too);
- teacher.py: on-policy distillation's teacher (distill.teacher_path): its tokenizer check, where it is held,
  its scoring pass (its terms in the update are the actor's: postrl/distill.py);
- critic.py: PPO's value model (algorithm.adv_estimator: gae), its optimizer, GAE and the value update.

The package stands above the actor (the critic and the teacher's pass drive its micro-batches); nothing below
the assembly and the trainer imports it.
"""
