"""Running trnsweep on AWS: the Ray cluster for trn2, buckets, the study database, capacity and cost.

Everything here is a thin, testable layer over boto3 (``python -m infra --help``); nothing in
``model/`` or ``sweep/`` imports it. Errors are :class:`infra.aws.InfraError` with a one-line
message and the CLI's exit code (2 bad input, 1 anything else). See ``docs/aws.md``.
"""
