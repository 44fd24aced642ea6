"""The Ray cluster, as every cluster job uses it: training's gang and scoring's Ray Data job.

``connect`` (join with a deadline, one error naming the address), ``node_settings`` (the servers
every node uses, S3 among them), ``job`` (a job cancelled whole), ``health`` (a lost node named).
Below the stages that run jobs on it (``tasks.train``, ``tasks.inference``); above ``shared``.
"""
