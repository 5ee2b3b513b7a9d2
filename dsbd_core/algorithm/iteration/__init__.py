"""One DSBD iteration, the paper's steps: the draft grows a forest layer by layer
(`draft_forest`), the target verifies it layer by layer with the residual rule (`verify`,
`verify_forest`), the width rule picks each layer's width (`width`, `width_distinct`), the next
beams and their pool (`beams`), and each side's work as one compiled graph (`side_graphs`).
`dsbd_core.algorithm.engine` composes these into the iteration's two sides."""
