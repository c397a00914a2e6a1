"""Where the pool's endpoints come from: static flags, a watched file, or Kubernetes."""
