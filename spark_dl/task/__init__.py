"""A Spark barrier task: rendezvous, the world layout, starting and watching its rank processes
(fresh or forked from the warm zygote), the relay for Spark Connect, writing its rows for the ranks."""
