"""Several processes, or one: the engines that drive a model, and the processes around them.

* ``engine``: one process, DDP and FSDP through accelerate, ZeRO through DeepSpeed, a pipeline, behind one interface;
* ``pipeline``: a decoder-only LM cut at its blocks into stages, one per process, run by torch's pipeline schedules;
* ``deepspeed_config``: the DeepSpeed JSON of a run, generated, with the user's file on top;
* ``launcher``: several processes on this machine through torchrun, and the parent they report to;
* ``rankwatch``: one failing rank ends the whole run within seconds, and the run says which one and why;
* ``failure``: where a worker's failure, or an abort, is reported (once, by the right process).
"""
