"""jsqueue: a durable, distributed outbound SMTP queue on NATS JetStream."""

__version__ = "0.1.0"
