"""Merging checkpoints: choosing them (:mod:`.discovery`), the key filter (:mod:`.keys`), the
streaming average (:mod:`.engine`), one merge from sources to published output (:mod:`.job`,
:mod:`.publish`, :mod:`.journal`), several processes (:mod:`.distributed`), checking an output
(:mod:`.verify`); the library entry points are in :mod:`.api`, their options in :mod:`.options`.

Nothing is imported here: ``import ckptavg.merging.keys`` must not pull in the engine.
"""
