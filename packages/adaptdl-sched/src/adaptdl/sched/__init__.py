"""AdaptDL's scheduler: the policies and the allocation round that the simulator
(``adaptdl.sim``) and the live scheduler both drive.

* ``adaptdl.sched.view``: what a round sees (``JobView``, ``ClusterState``);
* ``adaptdl.sched.policies``: the policies (``make_policy``) and their interface;
* ``adaptdl.sched.round``: one round (``allocation_round``): the policy's checked
  answer and each job's change.
"""
