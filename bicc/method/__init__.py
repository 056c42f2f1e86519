"""The method, mathematics only: policy losses (losses/), advantages with RCC (advantages/), the sampler's correction
against pi_old (correction), BiCC's contexts (conditioning), DAPO's overlong shaping and dynamic sampling rule (dapo),
the paper's diagnostics (diagnostics) and Algorithm 1 written plainly (reference). Imports ``bicc.model`` and below;
no speed or memory choice lives here."""
