"""Chat media parts checked before any engine work (hidden_states/media.py, deployments/http.py's check):
each refusal is a 400 naming the part and the reason; text, and good images and audio, pass."""

from __future__ import annotations

import ast
import base64
import importlib.util
import io
import json
from pathlib import Path

import pytest
from PIL import Image

from deployments.config import AppArgs
from deployments.http import check, failure
from hidden_states import media
from hidden_states.errors import Refused
from hidden_states.params import NOTHING, HiddenStatesRequestError
from tests.helpers import run
from tests.unit.test_ingress import call, make

LIMIT = 8 * 2**20


def image_bytes(fmt: str = "PNG", size=(4, 3)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, (200, 10, 10)).save(buf, fmt)
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def audio_part(data: str, fmt: str = "wav") -> dict:
    return {"type": "input_audio", "input_audio": {"data": data, "format": fmt}}


def chat(*parts, before=({"role": "system", "content": "be brief"},)) -> dict:
    """A request whose last message (messages[len(before)]) has a text part then `parts` (content[1], ...)."""
    return {"messages": [*before, {"role": "user", "content": [{"type": "text", "text": "what is it?"}, *parts]}]}


def refused(req: dict, **kw) -> HiddenStatesRequestError:
    with pytest.raises(HiddenStatesRequestError) as e:
        media.check_media(req, **{"max_media_bytes": LIMIT, "remote_media": False, **kw})
    return e.value


PNG = image_bytes("PNG")


def wav(rate: int = 16000, seconds: float = 0.001) -> bytes:
    import wave

    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(b"\0\0" * int(rate * seconds))
    return buf.getvalue()


WAV_B64 = base64.b64encode(wav()).decode()


@pytest.mark.parametrize(
    "part, param, words",
    [
        (image_part("data:image/png,iVBORw0KGgo="), "image_url", ["malformed data URL", "base64"]),
        (
            image_part("data:image/png;base64" + base64.b64encode(PNG).decode()),
            "image_url",
            ["malformed data URL", "no ','"],
        ),
        (
            image_part("data:;base64," + base64.b64encode(PNG).decode()),
            "image_url",
            ["malformed data URL", "media type"],
        ),
        (image_part("data:png;base64," + base64.b64encode(PNG).decode()), "image_url", ["'png' is not a media type"]),
        (image_part("data:image/png;base64,iVBO Rw0K"), "image_url", ["not valid base64"]),
        (image_part("data:image/png;base64,iVBORw0KGg"), "image_url", ["not valid base64"]),  # bad padding
        (
            image_part("data:image/png;base64," + base64.urlsafe_b64encode(b"\xfb\xff" * 30).decode()),
            "image_url",
            ["not valid base64"],
        ),
        (
            image_part("data:image/png;base64," + base64.b64encode(PNG).decode() + "\n"),
            "image_url",
            ["not valid base64"],
        ),
        (image_part("data:image/png;base64,é"), "image_url", ["not valid base64"]),
        (
            image_part("data:image/png;base64," + base64.b64encode(b"just some text").decode()),
            "image_url",
            ["not a readable image", "declared image/png", "PNG, JPEG"],
        ),
        (
            image_part(data_url(b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n", "image/png")),
            "image_url",
            ["unsupported image format EPS", "does not read it"],
        ),
        (image_part(data_url(PNG[:40])), "image_url", ["not a readable image", "cut short"]),  # a cut header
        (image_part(data_url(PNG[:60])), "image_url", ["PNG image is corrupt", "Truncated"]),
        (image_part(data_url(PNG[:-8] + b"\0" * 8)), "image_url", ["PNG image is corrupt"]),  # a bad IEND checksum
        (
            image_part("http://example.com/cat.png"),
            "image_url",
            ["does not fetch remote media", "remote_media is off", "data URL"],
        ),
        (image_part("HTTPS://example.com/cat.png"), "image_url", ["does not fetch remote media"]),
        (image_part("file:///etc/passwd"), "image_url", ["not a data URL", "file: URLs are not read"]),
        (image_part("cat.png"), "image_url", ["not a data URL"]),
        ({"type": "image_url", "image_url": "data:image/png;base64,AAAA"}, "image_url", ['{"url":']),
        ({"type": "image_url", "image_url": {}}, "image_url", ['{"url":']),
        (audio_part("UklGR!!!"), "input_audio", ["audio payload is not valid base64"]),
        (audio_part(""), "input_audio", ["non-empty data"]),
        ({"type": "input_audio", "input_audio": WAV_B64}, "input_audio", ['{"data":']),
        (
            {"type": "audio_url", "audio_url": {"url": "https://example.com/a.wav"}},
            "audio_url",
            ["does not fetch remote media", "send the audio as a data URL"],
        ),
        (
            {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}},
            "type",
            ["'video_url' part", "does not take", "image_url"],
        ),
        ({"type": "image_embeds", "image_embeds": "AAAA"}, "type", ["'image_embeds' part"]),
        ({"type": "banana"}, "type", ["'banana' part"]),
        ({"type": ["text"]}, "type", ["['text'] part"]),
        ({"video_url": {"url": "data:video/mp4;base64,AAAA"}}, "type", ["'video_url' part"]),  # vLLM's typeless form
        ({"text": "hi"}, "type", ["has no `type`"]),
    ],
)
def test_each_refusal_names_the_part_and_the_reason(part, param, words):
    err = refused(chat(part))
    where = "messages[1].content[1]"
    assert err.param == f"{where}.{param}" and str(err).startswith(where), (err.param, str(err))
    for w in words:
        assert w in str(err), (w, str(err))


def test_the_first_bad_part_is_named_wherever_it_is():
    req = {
        "messages": [
            {"role": "user", "content": [image_part(data_url(PNG)), "plain string part", image_part(data_url(PNG))]},
            {"role": "assistant", "content": "ok"},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "and"},
                    image_part(data_url(PNG)),
                    image_part("data:image/png;base64,@@@@"),
                ],
            },
        ]
    }
    assert refused(req).param == "messages[2].content[2].image_url"


@pytest.mark.parametrize(
    "fmt, mime",
    [
        ("PNG", "image/png"),
        ("JPEG", "image/jpeg"),
        ("WEBP", "image/webp"),
        ("GIF", "image/gif"),
        ("BMP", "image/bmp"),
        ("JPEG", "image/png"),
    ],
)
def test_images_vllm_reads_pass(fmt, mime):
    data = image_bytes(fmt)
    with Image.open(io.BytesIO(data)) as im:
        assert im.format == fmt
    media.check_media(chat(image_part(data_url(data, mime))), max_media_bytes=LIMIT, remote_media=False)


def test_good_audio_and_other_forms_vllm_takes_pass():
    ok = chat(
        audio_part(WAV_B64),
        audio_part(WAV_B64, "mp3"),
        {"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64," + WAV_B64}},
        {"image_url": data_url(PNG)},  # vLLM's typeless form: the url as a string
        {
            "type": "image_url",
            "image_url": {"url": "DATA:image/png;charset=x;base64," + base64.b64encode(PNG).decode()},
        },
        {"type": "image_url", "image_url": None, "uuid": "img-1"},  # vLLM's media cache: a uuid alone
        {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}, "uuid": "a-1"},
        {"type": "refusal", "refusal": "no"},
        {"type": "input_text", "text": "x"},
    )
    media.check_media(ok, max_media_bytes=LIMIT, remote_media=False)
    assert media.count_media(ok) == {"audio": 4, "image": 3}


@pytest.mark.parametrize(
    "req",
    [
        {},
        {"prompt": "x"},
        {"messages": "not a list"},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}, "odd", 7]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, "a string part", 5, None]}]},
        {"messages": [{"role": "user", "content": [{"type": "thinking", "thinking": "x"}]}]},
    ],
)
def test_requests_without_media_pass_untouched(req):
    before = json.dumps(req)
    media.check_media(req, max_media_bytes=1, remote_media=False)
    assert json.dumps(req) == before and media.count_media(req) == {}


def test_text_only_requests_decode_nothing(monkeypatch):
    def no(*a, **k):
        raise AssertionError("decoded")

    monkeypatch.setattr(media.base64, "b64decode", no)
    monkeypatch.setattr(media, "_check_image", no)
    media.check_media(
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "x" * 10_000}] * 50}]},
        max_media_bytes=1,
        remote_media=False,
    )


def test_the_size_limit_is_per_part_and_inclusive():
    n = len(PNG)
    image = chat(image_part(data_url(PNG)), image_part(data_url(PNG)))
    media.check_media(image, max_media_bytes=n, remote_media=False)  # each at the limit: fine
    err = refused(image, max_media_bytes=n - 1)
    assert err.param == "messages[1].content[1].image_url"
    assert f"is {n} bytes (decoded), above this server's limit of {n - 1} bytes" in str(err)
    assert "max_media_bytes" in str(err)

    for size in (1, 2, 3, 4, 5, 6):  # every padding: the size checked before decoding is the decoded size
        data = base64.b64encode(b"\1" * size).decode()
        # at the limit the size passes, and the bytes are then read as audio (and are not audio)
        assert "not a readable audio file" in str(refused(chat(audio_part(data, "mp3")), max_media_bytes=size))
        err = refused(chat(audio_part(data, "mp3")), max_media_bytes=size - 1 or 1) if size > 1 else None
        assert err is None or (err.param == "messages[1].content[1].input_audio" and f"is {size} bytes" in str(err))


def clip(rate: int, fmt: str, seconds: float = 0.05, channels: int = 1) -> str:
    import numpy as np
    import soundfile

    buf = io.BytesIO()
    x = 0.3 * np.sin(np.arange(int(rate * seconds)) * 0.1)
    soundfile.write(
        buf,
        np.stack([x] * channels, axis=1).astype("float32"),
        rate,
        format=fmt.upper(),
        subtype={"wav": "PCM_16", "flac": "PCM_16", "mp3": "MPEG_LAYER_III", "ogg": "VORBIS"}[fmt],
    )
    return base64.b64encode(buf.getvalue()).decode()


@pytest.mark.parametrize("fmt", ["wav", "flac", "mp3", "ogg"])
@pytest.mark.parametrize("rate", [8000, 22050, 44100, 48000])
def test_audio_at_any_rate_in_every_format_vllm_decodes_passes(fmt, rate):
    data = clip(rate, fmt, channels=2 if rate == 44100 else 1)
    media.check_media(chat(audio_part(data, fmt)), max_media_bytes=LIMIT, remote_media=False)
    media.check_media(
        chat({"type": "audio_url", "audio_url": {"url": f"data:audio/{fmt};base64,{data}"}}),
        max_media_bytes=LIMIT,
        remote_media=False,
    )


@pytest.mark.parametrize(
    "data, fmt, param, words",
    [
        (
            base64.b64encode(b"RIFF\x24\x00\x00\x00WAVEfmt ").decode(),
            "wav",
            "input_audio",
            ["not a readable audio file"],
        ),
        (
            base64.b64encode(b"ID3 this is no mp3 at all" * 4).decode(),
            "mp3",
            "input_audio",
            ["not a readable audio file"],
        ),
        (
            base64.b64encode(base64.b64decode(clip(16000, "flac", 0.5))[:60]).decode(),
            "flac",
            "input_audio",
            ["not a readable audio file"],
        ),  # a FLAC cut inside its header
        (base64.b64encode(wav(16000, 0.0)).decode(), "wav", "input_audio", ["has no samples"]),
        (base64.b64encode(wav(500, 0.1)).decode(), "wav", "input_audio", ["500 Hz", "1000 to 384000 Hz"]),
        (WAV_B64, "aiff", "input_audio.format", ["unknown audio format 'aiff'", "wav, flac, mp3, ogg"]),
    ],
)
def test_bad_audio_is_refused_naming_the_part(data, fmt, param, words):
    err = refused(chat(audio_part(data, fmt)))
    assert err.param == f"messages[1].content[1].{param}", err.param
    assert all(w in str(err) for w in words), str(err)


def test_a_bad_audio_data_url_is_refused_naming_the_part():
    err = refused(
        chat(
            {
                "type": "audio_url",
                "audio_url": {"url": "data:audio/wav;base64," + base64.b64encode(b"not audio").decode()},
            }
        )
    )
    assert err.param == "messages[1].content[1].audio_url" and "not a readable audio file" in str(err)


def test_a_payload_above_the_limit_is_not_decoded(monkeypatch):
    monkeypatch.setattr(media.base64, "b64decode", lambda *a, **k: (_ for _ in ()).throw(AssertionError("decoded")))
    err = refused(chat(audio_part("A" * 4000)), max_media_bytes=1000)
    assert "3000 bytes" in str(err)


def test_remote_urls_are_refused_unless_remote_media():
    req = chat(
        image_part("https://example.com/cat.png"),
        {"type": "audio_url", "audio_url": {"url": "http://example.com/a.mp3"}},
    )
    err = refused(req)
    assert err.param == "messages[1].content[1].image_url"
    assert "this server does not fetch remote media" in str(err) and "send the image as a data URL" in str(err)
    media.check_media(req, max_media_bytes=LIMIT, remote_media=True)  # the engine's to fetch
    assert "file: URLs are not read" in str(refused(chat(image_part("file:///x.png")), remote_media=True))


def test_the_image_formats_are_vllms():
    """IMAGE_FORMATS is vLLM's ALLOWED_IMAGE_FORMATS (read from its source: vLLM is not imported)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vLLM is not installed")
    source = Path(spec.submodule_search_locations[0], "multimodal", "image.py").read_text()
    node = next(
        n
        for n in ast.walk(ast.parse(source))
        if isinstance(n, ast.AnnAssign) and getattr(n.target, "id", None) == "ALLOWED_IMAGE_FORMATS"
    )
    assert media.IMAGE_FORMATS == ast.literal_eval(node.value)


# Through the ingress's check, as both ingresses run it.

ARGS = AppArgs(model="builtin:tiny-llama", max_media_bytes=len(PNG))


def checked(args: AppArgs, body: dict, route: str = "chat"):
    """(parsed body, spec) as the ingress admits it, or (status, error) as it answers its refusal."""
    try:
        return check(args, json.dumps(body).encode(), route)
    except Refused as e:
        out = failure(e)
        return out.status_code, json.loads(out.body)["error"]


@pytest.mark.parametrize(
    "part, param, words",
    [
        (image_part("data:image/png;base64,####"), "image_url", "not valid base64"),
        (image_part(data_url(image_bytes("PNG", (64, 64)))), "image_url", "max_media_bytes"),
        (image_part("https://example.com/cat.png"), "image_url", "does not fetch remote media"),
        (image_part(data_url(PNG[:60])), "image_url", "corrupt"),
        (image_part(data_url(b"GIF89a-not-really")), "image_url", "not a readable image"),
        ({"type": "video_url", "video_url": {"url": "x"}}, "type", "'video_url' part"),
    ],
)
def test_refusals_through_the_ingress_check(part, param, words):
    status, err = checked(ARGS, {"model": "tiny-llama", **chat(part), "return_hidden_states": True})
    assert status == 400 and err["code"] == 400 and err["type"] == "BadRequestError", err
    assert err["param"] == f"messages[1].content[1].{param}" and words in err["message"], err


def test_the_ingress_check_passes_good_media_and_leaves_other_routes_alone():
    good = chat(image_part(data_url(PNG)), audio_part(WAV_B64))
    req, spec = checked(ARGS, good)
    assert req == good and spec == NOTHING
    bad = chat(image_part("https://example.com/cat.png"))
    assert checked(AppArgs(model="builtin:tiny-llama", remote_media=True), bad)[0] == bad
    assert checked(ARGS, bad, "completions")[0] == bad  # no chat messages to render there
    status, err = checked(ARGS, bad, "hidden_states")  # a verification's messages are rendered: checked alike
    assert status == 400 and "does not fetch remote media" in err["message"], err
    local = chat(image_part("file:///srv/media/cat.png"))  # read by the engine under its allowed path
    assert checked(ARGS, local)[0] == 400
    allowed = AppArgs(model="builtin:tiny-llama", engine={"allowed_local_media_path": "/srv/media"})
    assert checked(allowed, local)[0] == local
    # the fields' own checks come first, as before
    status, err = checked(ARGS, {**bad, "return_hidden_states": "yes"})
    assert status == 400 and err["param"] == "return_hidden_states"


def test_a_refused_part_never_reaches_the_engine():
    async def go():
        r = await make(max_media_bytes=10)
        return r, await call(r, "POST", "/v1/chat/completions", json=chat(image_part(data_url(PNG))))

    r, res = run(go())
    assert res.status_code == 400 and res.json()["error"]["param"] == "messages[1].content[1].image_url", res.text
    assert r.engine.requests == 0
