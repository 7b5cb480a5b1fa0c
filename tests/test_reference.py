import pytest

from image_builder.oci.reference import ReferenceError, parse


@pytest.mark.parametrize("text,registry,repo,tag,digest,api", [
    ("python:3.12", "docker.io", "library/python", "3.12", None, "registry-1.docker.io"),
    ("python", "docker.io", "library/python", "latest", None, "registry-1.docker.io"),
    ("user/img", "docker.io", "user/img", "latest", None, "registry-1.docker.io"),
    ("index.docker.io/library/debian:12", "docker.io", "library/debian", "12", None, "registry-1.docker.io"),
    ("ghcr.io/org/team/img:v1.2", "ghcr.io", "org/team/img", "v1.2", None, "ghcr.io"),
    ("127.0.0.1:5000/test/multi:1", "127.0.0.1:5000", "test/multi", "1", None, "127.0.0.1:5000"),
    ("localhost/img", "localhost", "img", "latest", None, "localhost"),
    ("registry.example:443/a/b@sha256:" + "a" * 64, "registry.example:443", "a/b", None, "sha256:" + "a" * 64,
     "registry.example:443"),
    ("python:3.12@sha256:" + "b" * 64, "docker.io", "library/python", "3.12", "sha256:" + "b" * 64,
     "registry-1.docker.io"),
])
def test_normalisation(text, registry, repo, tag, digest, api):
    ref = parse(text)
    assert (ref.registry, ref.repository, ref.tag, ref.digest, ref.api_host) == (registry, repo, tag, digest, api)
    assert ref.version == (digest or tag)


def test_str_round_trips():
    assert str(parse("python:3.12")) == "docker.io/library/python:3.12"
    assert parse(str(parse("ghcr.io/a/b:c"))) == parse("ghcr.io/a/b:c")


@pytest.mark.parametrize("text,needle", [
    ("", "empty"),
    ("Python:3", "lowercase"),
    ("img@sha256:abc", "digest"),
    ("img:bad tag", "spaces"),
    ("img:-x", "tag"),
])
def test_bad_references_name_the_problem(text, needle):
    with pytest.raises(ReferenceError, match=needle):
        parse(text)
