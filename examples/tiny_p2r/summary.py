"""Print the demo's summary: where things are, eval loss before/after delinking, final loss."""

import json
import sys


def last(path, key):
    value = None
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            record = json.loads(line)
            if key in record:
                value = record[key]
    return value


def main(out: str, seconds: str) -> None:
    pseudo = last(f"{out}/eval_pseudo.jsonl", "eval_loss")
    delinked = last(f"{out}/eval_real_init.jsonl", "eval_loss")
    final_eval = last(f"{out}/eval_real_final.jsonl", "eval_loss")
    final_train = last(f"{out}/real.jsonl", "lm_loss")
    print(f"""
Pseudo-to-Real demo finished in {int(seconds) // 60} min {int(seconds) % 60} s
  logs:         {out}/pseudo.jsonl, {out}/real.jsonl
  checkpoints:  {out}/pseudo (pseudo, TP2xPP2xEP2), {out}/real_init (delinked, TP1xPP2xEP2), {out}/real
  loss plot:    {out}/loss.png
  eval loss of the pseudo model:          {pseudo:.6f}
  eval loss of the delinked real model:   {delinked:.6f}   ({"equal" if abs(pseudo - delinked) < 1e-4 else "DIFFERENT"})
  final train loss {final_train:.4f}, final eval loss {final_eval:.4f}""")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
