"""`python -m orchestrator doctor`: is this host ready to run a topology on a target?

Split by role:

- `checks`: `Check` and the checks every engine target shares (daemon, shm, data,
  disk, port), pure functions of (topology, facts);
- `facts`: `Facts` and `gather`, which asks the host and judges nothing;
- `probe`: the GPU probe container's program, its parsing and its run;
- `report`: the lines, the summary, and the one-line refusal `up` raises.

Each target's own checks (and the facts only it needs) live with its backend
(`orchestrator/backends/<target>/doctor.py`); the backend lists its checks in
order, and `run_checks` runs that list. Unit tests feed the checks facts.

Exit status of `doctor`: 0 only if every check passes; `up` and `stack-up`
run the same checks first and start nothing when one fails.
"""
