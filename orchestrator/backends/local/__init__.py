"""The local target: the job's services as processes of this host, under one launcher."""
