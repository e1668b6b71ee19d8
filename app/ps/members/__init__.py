"""Who is in the job, as the PS sees it: the roster, the store's member list, pings and drops."""
