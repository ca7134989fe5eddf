"""The manual forms: the user says where to recompute.

``checkpoint`` runs a function or module and runs it again in backward; ``checkpoint_sequential``
cuts a chain into segments of it; ``scope`` records the ATen ops of a block of code on a *tape*
(``tape``) and, in backward, *replays* the slice of it that leads to what autograd asks for
(``replay``, eagerly, or ``fused`` with runs compiled by ``torch.compile``). A policy
(``remat.policy``) decides per op what to keep; ``selective`` applies one inside ``checkpoint``.
``buffers``, ``checks`` and ``autocast`` hold what a recomputation run again from Python must get
right: buffers written in forward, values checked against the forward, autocast settings.
``keywords`` reads the keywords of ``torch.utils.checkpoint`` as remat settings, so that code
written for torch runs on ``checkpoint`` and ``checkpoint_sequential`` unchanged.
"""
