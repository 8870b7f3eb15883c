#!/usr/bin/env python3
"""Writes configs/zeroshot/ from the published metadata, so align ships the same class names,
prompt templates and label order that CLIP / open_clip evaluations use.

Sources (downloaded as wheels from PyPI with `pip download --no-deps`, never imported):
- open_clip_torch: `open_clip/zero_shot_metadata.py` — the 1000 ImageNet class names (label order)
  and OpenAI's 80 prompt templates;
- timm: `timm/data/_info/` — the WordNet id of each label (sorted wnids, the usual ImageNet label
  order) and the 200-class subsets of ImageNet-R and ImageNet-A as indices into the 1000.

Run by hand: python3 scripts/export_zeroshot_metadata.py
"""
import ast
import os
import subprocess
import sys
import tempfile
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "configs", "zeroshot")


def wheel(tmp, name):
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, name], check=True)
    [path] = [os.path.join(tmp, f) for f in os.listdir(tmp) if f.lower().startswith(name.replace("-", "_").lower()) and f.endswith(".whl")]
    return zipfile.ZipFile(path)


def template_of(node):
    """`lambda c: f'a photo of a {c}.'` -> 'a photo of a {}.'"""
    assert isinstance(node, ast.Lambda) and isinstance(node.body, ast.JoinedStr), ast.dump(node)
    parts = []
    for v in node.body.values:
        if isinstance(v, ast.Constant):
            parts.append(v.value.replace("{", "{{").replace("}", "}}"))
        else:
            parts.append("{}")
    return "".join(parts)


def assignment(tree, name):
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in stmt.targets):
            return stmt.value
    raise KeyError(name)


def write(name, lines):
    with open(os.path.join(OUT, name), "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"{name}: {len(lines)} lines")


def main():
    os.makedirs(OUT, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        oc = wheel(tmp, "open_clip_torch")
        tree = ast.parse(oc.read("open_clip/zero_shot_metadata.py").decode())
        classes = [e.value for e in assignment(tree, "IMAGENET_CLASSNAMES").elts]
        templates = [template_of(e) for e in assignment(tree, "OPENAI_IMAGENET_TEMPLATES").elts]
        simple = [template_of(e) for e in assignment(tree, "SIMPLE_IMAGENET_TEMPLATES").elts]
        tm = wheel(tmp, "timm")
        info = lambda f: tm.read(f"timm/data/_info/{f}").decode().split()
        wnids = info("imagenet_synsets.txt")
        r_idx, a_idx = info("imagenet_r_indices.txt"), info("imagenet_a_indices.txt")
    assert len(classes) == 1000 and len(wnids) == 1000 and len(templates) == 80
    assert len(r_idx) == 200 and len(a_idx) == 200
    write("imagenet_classes.txt", classes)
    write("imagenet_wnids.txt", wnids)
    write("imagenet_templates.txt", templates)
    write("imagenet_templates_simple.txt", simple)
    write("imagenet_single_template.txt", ["a photo of a {}."])
    write("imagenet_r_indices.txt", r_idx)
    write("imagenet_a_indices.txt", a_idx)


if __name__ == "__main__":
    main()
