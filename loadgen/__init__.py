"""loadgen: an SLO load generator for specpage's streaming gRPC API.

Open-loop arrivals (Poisson, gamma, constant), closed-loop concurrency and trace
replay; latency is measured from each request's *scheduled* arrival, so a server
(or client) that falls behind shows up in the numbers instead of hiding in them.
"""
