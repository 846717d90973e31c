"""Client-level differential privacy of what a method uploads: `dp` clips and noises each phase's uploads as the
method's `core.UploadPrivacy` declares (`privatize`), and `budget` accounts the run's epsilon (dp-accounting's RDP
and PLD accountants). The attacks that measure what leaks without it are in `fedjax_het.evaluation`."""
