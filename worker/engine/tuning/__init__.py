"""Engine tuning: the kernel tuner that picks each op's fastest variant and thread count on this host
while the worker runs, and the store of the tables it learned."""
