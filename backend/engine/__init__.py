"""Engine core: executor, scheduler, KV block manager, request state, sampler, step inputs."""
