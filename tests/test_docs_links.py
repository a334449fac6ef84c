"""Every relative link of the user-facing Markdown (README.md, docs/*.md,
benchmarks/README.md) reaches a file that exists and, with a #fragment, an anchor of
that file: an explicit <a id="..."> or a heading's GitHub slug. Also every
``docs/<name>.md#<anchor>`` named in the sources, tests and notebooks. Pure Python, no jax."""

import functools
import pathlib
import re
import subprocess

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _slug(heading: str) -> str:
  """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces ->
  '-' (a heading with unusual characters is safer behind an explicit <a id>)."""
  return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@functools.cache
def _anchors(path: pathlib.Path) -> frozenset[str]:
  text = path.read_text()
  return frozenset(re.findall(r'<a id="([^"]+)"', text)) | {
      _slug(m) for m in re.findall(r"^#+ (.*)$", text, re.M)}


def _broken(source: pathlib.Path, link: str) -> str | None:
  if re.match(r"[a-z]+:", link):  # http:, https:, mailto:
    return None
  path, _, anchor = link.partition("#")
  target = (source.parent / path).resolve() if path else source
  if not target.exists():
    return f"{source.relative_to(ROOT)}: {link}: no such file"
  if anchor and target.suffix == ".md" and anchor not in _anchors(target):
    return f"{source.relative_to(ROOT)}: {link}: no anchor #{anchor} in {path or 'itself'}"
  return None


def test_markdown_links_resolve():
  docs = [ROOT / "README.md", ROOT / "benchmarks" / "README.md",
          *sorted((ROOT / "docs").glob("*.md"))]
  broken = []
  for doc in docs:
    text = doc.read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", text)  # [text](link)
    links += re.findall(r"^\[[^\]]+\]: (\S+)", text, re.M)  # [ref]: link
    broken += [b for link in links if (b := _broken(doc, link))]
  assert not broken, "broken links:\n" + "\n".join(broken)


def test_docs_anchors_named_in_files_exist():
  try:
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
  except (OSError, subprocess.CalledProcessError):  # not a git checkout: walk the tree
    files = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*")
             if ".venv" not in p.parts and ".git" not in p.parts]
  broken = []
  for name in files:
    path = ROOT / name
    if path.suffix not in (".py", ".md", ".ipynb", ".sh") or not path.is_file():
      continue
    for doc, anchor in re.findall(r"docs/([\w-]+\.md)#([\w-]+)", path.read_text()):
      target = ROOT / "docs" / doc
      if not target.exists() or anchor not in _anchors(target):
        broken.append(f"{name}: docs/{doc}#{anchor}")
  assert not broken, "anchors that do not exist:\n" + "\n".join(broken)
