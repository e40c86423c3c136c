"""A synthetic corpus of agent turns for the privacy detector: planted secrets and personal data, and clean
look-alikes that must pass. Every value is generated from a fixed seed in its real format (never a real secret).

`planted(seed)` gives turns that each hold one item (`category`: `secret` or a PII category; `value`: the exact
planted string); `clean(seed)` gives turns with none (UUIDs, git SHAs, sha256 digests, base64 images, version
strings, container ids, random-looking identifiers in code). `bench/studies/redaction.py` and the tests use both.
"""

from __future__ import annotations

import base64
import random
import string
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import phonenumbers
from stdnum import iban as stdnum_iban

ALNUM = string.ascii_letters + string.digits
UPPER_NUM = string.ascii_uppercase + string.digits
B64 = ALNUM + "+/"
URLSAFE = ALNUM + "-_"
HEX = "0123456789abcdef"


@dataclass(frozen=True)
class Item:
    """One turn of the corpus; `value` (the planted item) is empty for clean turns."""

    category: str
    kind: str
    text: str
    value: str = ""


def _s(rng: random.Random, alphabet: str, n: int) -> str:
    return "".join(rng.choice(alphabet) for _ in range(n))


def _mixed(rng: random.Random, alphabet: str, n: int) -> str:
    """A random string that has an upper-case letter, a lower-case letter and a digit (as real keys do)."""
    while True:
        s = _s(rng, alphabet, n)
        if any(c.isupper() for c in s) and any(c.islower() for c in s) and any(c.isdigit() for c in s):
            return s


def _b64url(obj: str) -> str:
    return base64.urlsafe_b64encode(obj.encode()).decode().rstrip("=")


# ---- secret values ------------------------------------------------------------------------------------------
def _jwt(rng: random.Random) -> str:
    header = _b64url('{"alg":"HS256","typ":"JWT"}')
    payload = _b64url(f'{{"sub":"{rng.randint(1000, 99999)}","iat":{rng.randint(1600000000, 1800000000)}}}')
    return f"{header}.{payload}.{_s(rng, URLSAFE, 43)}"


def _pem(rng: random.Random) -> str:
    kind = rng.choice(["RSA PRIVATE KEY", "PRIVATE KEY", "OPENSSH PRIVATE KEY", "EC PRIVATE KEY"])
    body = "\n".join(_s(rng, B64, 64) for _ in range(rng.randint(4, 8)))
    return f"-----BEGIN {kind}-----\n{body}\n-----END {kind}-----"


SECRET_VALUES: dict[str, Callable[[random.Random], str]] = {
    "aws_access_key": lambda r: "AKIA" + _s(r, UPPER_NUM, 16),
    "aws_secret_key": lambda r: _mixed(r, B64, 40),
    "gcp_api_key": lambda r: "AIza" + _s(r, URLSAFE, 35),
    "azure_storage_key": lambda r: _mixed(r, B64, 86) + "==",
    "github_token": lambda r: r.choice(["ghp_", "gho_", "ghs_"]) + _mixed(r, ALNUM, 36),
    "github_pat": lambda r: "github_pat_" + _mixed(r, ALNUM, 22) + "_" + _mixed(r, ALNUM, 59),
    "gitlab_token": lambda r: "glpat-" + _mixed(r, URLSAFE, 20),
    "slack_token": lambda r: f"xoxb-{r.randint(10**10, 10**11)}-{r.randint(10**12, 10**13)}-{_mixed(r, ALNUM, 24)}",
    "stripe_key": lambda r: r.choice(["sk_live_", "rk_live_", "sk_test_"]) + _mixed(r, ALNUM, 24),
    "openai_key": lambda r: "sk-proj-" + _mixed(r, URLSAFE, 48),
    "anthropic_key": lambda r: "sk-ant-api03-" + _mixed(r, URLSAFE, 93) + "AA",
    "huggingface_token": lambda r: "hf_" + _mixed(r, ALNUM, 34),
    "jwt": _jwt,
    "private_key": _pem,
    "db_password": lambda r: _mixed(r, ALNUM, r.randint(10, 18)) + r.choice("!#%&*"),
    "generic_api_key": lambda r: _mixed(r, ALNUM, 32),
}

# Where a secret turns up in an agent's turn: {v} is the value
SECRET_CONTEXTS: dict[str, list[str]] = {
    "aws_access_key": [
        "$ cat .env\nAWS_REGION=eu-west-1\nAWS_ACCESS_KEY_ID={v}\nLOG_LEVEL=info",
        "[tool: bash] aws configure list\n      Name   Value\n access_key   {v}   shared-credentials-file",
        "boto3.client('s3', aws_access_key_id='{v}', region_name='us-east-1')",
    ],
    "aws_secret_key": [
        "$ cat ~/.aws/credentials\n[default]\naws_access_key_id = AKIA{u16}\naws_secret_access_key = {v}",
        "export AWS_SECRET_ACCESS_KEY={v}\nexport AWS_DEFAULT_REGION=us-west-2",
        "The upload failed. I used the key {v} from the vault; can you check the bucket policy?",
    ],
    "gcp_api_key": [
        'const maps = new google.maps.Map(el, {{ key: "{v}" }});',
        'curl \'https://maps.googleapis.com/maps/api/geocode/json?address=Paris&key={v}\'\n{{"status": "OK"}}',
    ],
    "azure_storage_key": [
        "AZURE_STORAGE_CONNECTION_STRING=DefaultEndpointsProtocol=https;AccountName=prodlogs;AccountKey={v};"
        "EndpointSuffix=core.windows.net",
        'az storage account keys list -n prodlogs\n[{{"keyName": "key1", "value": "{v}"}}]',
    ],
    "github_token": [
        "$ git push\nremote: Invalid username or token. Used https://x-access-token:{v}@github.com/acme/api.git",
        'curl -H \'Authorization: token {v}\' https://api.github.com/user/repos\n{{"message": "Bad credentials"}}',
        "GITHUB_TOKEN={v} gh pr create --fill",
    ],
    "github_pat": ["Here is my fine-grained token, please set up the CI secret: {v}"],
    "gitlab_token": [
        "$ cat .gitlab-ci.env\nCI_DEPLOY_TOKEN={v}",
        'curl --header "PRIVATE-TOKEN: {v}" https://gitlab.example.org/api/v4/projects',
    ],
    "slack_token": [
        "slack_client = WebClient(token=\"{v}\")\nslack_client.chat_postMessage(channel='#ops', text='deploy ok')",
        "2026-11-02T10:14:03Z ERROR slack: invalid_auth for token {v}",
    ],
    "stripe_key": [
        "stripe.api_key = \"{v}\"\ncharge = stripe.Charge.create(amount=2000, currency='eur')",
        "$ cat .env.production\nSTRIPE_SECRET_KEY={v}\nSTRIPE_CURRENCY=eur",
    ],
    "openai_key": [
        "$ cat .env\nOPENAI_API_KEY={v}\nMODEL=gpt-4o-mini",
        "openai.AuthenticationError: Error code: 401 - Incorrect API key provided: {v}.",
        'client = OpenAI(api_key="{v}")',
    ],
    "anthropic_key": [
        "$ env | grep ANTHROPIC\nANTHROPIC_API_KEY={v}",
        'curl https://api.anthropic.com/v1/messages -H "x-api-key: {v}" -H "anthropic-version: 2023-06-01"',
    ],
    "huggingface_token": [
        "huggingface-cli login --token {v}\nToken is valid (permission: write).",
        'from huggingface_hub import login\nlogin("{v}")',
    ],
    "jwt": [
        "$ curl -v https://api.internal/v2/orders\n> GET /v2/orders HTTP/1.1\n> Authorization: Bearer {v}\n"
        "< HTTP/1.1 403 Forbidden",
        "localStorage.setItem('session', '{v}')",
        "The cookie was auth={v}; Path=/; HttpOnly",
    ],
    "private_key": [
        "$ cat ~/.ssh/id_deploy\n{v}",
        '{{"type": "service_account", "private_key": "{vjson}", "client_email": "ci@proj.iam"}}',
    ],
    "db_password": [
        "DATABASE_URL=postgres://app_user:{v}@db.prod.internal:5432/orders",
        "Server=tcp:sql01.corp.local,1433;Database=crm;User Id=svc_crm;Password={v};Encrypt=True;",
        "$ cat config/database.yml\nproduction:\n  adapter: postgresql\n  username: deploy\n  password: {v}",
        "mysql -h 10.0.3.4 -u root -p'{v}' -e 'show databases'",
        "redis-cli -u redis://default:{v}@cache.internal:6379 ping",
    ],
    "generic_api_key": [
        "$ cat .env\nSENDINBLUE_API_KEY={v}\nFROM_ADDRESS=ops",
        'headers = {{"X-API-Key": "{v}", "Accept": "application/json"}}',
        "settings.py:\nPAYMENT_GATEWAY_SECRET = '{v}'",
        "I rotated it, the new one is {v} - does the webhook still verify?",
    ],
}


# ---- PII values ---------------------------------------------------------------------------------------------
FIRST = ["maria", "jon", "li", "amelie", "omar", "sofia", "kenji", "ana", "lukas", "priya", "tomas", "ines"]
LAST = ["keller", "okafor", "nguyen", "rossi", "haddad", "lindqvist", "moreau", "silva", "novak", "sato"]
DOMAINS = ["gmail.com", "outlook.com", "proton.me", "acme-corp.io", "uni-bonn.de", "fastmail.fm", "web.de"]


def _email(r: random.Random) -> str:
    sep = r.choice([".", "_", ""])
    return f"{r.choice(FIRST)}{sep}{r.choice(LAST)}{r.randint(1, 99) if r.random() < 0.4 else ''}@{r.choice(DOMAINS)}"


def _phone(r: random.Random) -> str:
    while True:
        region, prefix, n = r.choice([("US", "+1", 10), ("GB", "+44", 10), ("DE", "+49", 11), ("FR", "+33", 9)])
        national = str(r.randint(2, 9)) + _s(r, string.digits, n - 1)
        num = phonenumbers.parse(prefix + national)
        if phonenumbers.is_valid_number(num):
            fmt = r.choice([phonenumbers.PhoneNumberFormat.INTERNATIONAL, phonenumbers.PhoneNumberFormat.NATIONAL])
            if region != "US":
                fmt = phonenumbers.PhoneNumberFormat.INTERNATIONAL
            return phonenumbers.format_number(num, fmt)


def _card(r: random.Random) -> str:
    prefix, n = r.choice([("4", 16), ("51", 16), ("55", 16), ("2221", 16), ("34", 15), ("37", 15), ("6011", 16)])
    body = prefix + _s(r, string.digits, n - len(prefix) - 1)
    total = 0
    for i, d in enumerate(reversed(body)):
        d = int(d) * (2 if i % 2 == 0 else 1)
        total += d - 9 if d > 9 else d
    digits = body + str((10 - total % 10) % 10)
    sep = r.choice(["", " ", "-"])
    return sep.join(digits[i : i + 4] for i in range(0, len(digits), 4)) if sep else digits


def _iban(r: random.Random) -> str:
    country, bban = r.choice([
        ("DE", lambda: _s(r, string.digits, 18)),
        ("FR", lambda: _s(r, string.digits, 23)),
        ("GB", lambda: "NWBK" + _s(r, string.digits, 14)),
        ("NL", lambda: "ABNA" + _s(r, string.digits, 10)),
        ("ES", lambda: _s(r, string.digits, 20)),
    ])  # fmt: skip
    while True:
        b = bban()
        number = country + "00" + b
        number = country + stdnum_iban.calc_check_digits(number) + b
        if stdnum_iban.is_valid(number):
            return stdnum_iban.format(number) if r.random() < 0.5 else number


def _ip(r: random.Random) -> str:
    while True:
        a = r.choice([23, 31, 45, 52, 81, 88, 104, 142, 151, 185, 203, 212])
        ip = f"{a}.{r.randint(0, 255)}.{r.randint(0, 255)}.{r.randint(1, 254)}"
        import ipaddress

        if ipaddress.ip_address(ip).is_global:
            return ip


PII_VALUES: dict[str, Callable[[random.Random], str]] = {
    "email": _email, "phone": _phone, "card": _card, "iban": _iban, "ip": _ip,
}  # fmt: skip
PII_CONTEXTS: dict[str, list[str]] = {
    "email": [
        "Please send the invoice to {v} and cc me.",
        "$ git log -1\ncommit {sha}\nAuthor: Dev <{v}>\nDate:   Mon Nov 3 10:00:00 2026",
        "users.csv:\nid,name,email\n17,Customer,{v}",
    ],
    "phone": [
        "Call me at {v} if the deploy breaks tonight.",
        'Customer record: {{"name": "A. Client", "phone": "{v}", "tier": "gold"}}',
        "Ticket #4411: caller left a voicemail, number {v}, asks about the refund.",
    ],
    "card": [
        "My card {v} was declined twice, exp 09/28.",
        "stripe test log: charge failed for card_number={v} reason=insufficient_funds",
    ],
    "iban": [
        "Please wire the deposit to {v} (reference: flat 4B).",
        'payout_account: {{"iban": "{v}", "holder": "Studio GmbH"}}',
    ],
    "ip": [
        "sshd[1123]: Failed password for root from {v} port 52811 ssh2",
        '{v} - - [03/Nov/2026:10:01:12 +0000] "GET /login HTTP/1.1" 401 512',
        "My home IP is {v}, please allowlist it on the firewall.",
    ],
}


def _fill(template: str, value: str, r: random.Random) -> str:
    return template.format(
        v=value,
        vjson=value.replace("\n", "\\n"),
        u16=_s(r, UPPER_NUM, 16),
        sha=_s(r, HEX, 40),
    )


def planted(seed: int = 0, per_kind: int = 10) -> list[Item]:
    """Turns that each hold one planted secret or PII item: `per_kind` of every kind, contexts taken in turn."""
    r = random.Random(seed)
    out: list[Item] = []
    for kind, make in SECRET_VALUES.items():
        for i in range(per_kind):
            value = make(r)
            template = SECRET_CONTEXTS[kind][i % len(SECRET_CONTEXTS[kind])]
            shown = value.replace("\n", "\\n") if "{vjson}" in template else value  # as the text holds it
            out.append(Item("secret", kind, _fill(template, value, r), shown))
    for category, make in PII_VALUES.items():
        for i in range(per_kind):
            value = make(r)
            template = PII_CONTEXTS[category][i % len(PII_CONTEXTS[category])]
            out.append(Item(category, category, _fill(template, value, r), value))
    return out


# ---- clean look-alikes --------------------------------------------------------------------------------------
def _png_b64(r: random.Random) -> str:
    raw = b"\x89PNG\r\n\x1a\n" + bytes(r.getrandbits(8) for _ in range(r.randint(60, 300)))
    return base64.b64encode(raw).decode()


CLEAN: dict[str, list[Callable[[random.Random], str]]] = {
    "uuid": [
        lambda r: f"Created order {uuid.UUID(int=r.getrandbits(128), version=4)} for the customer.",
        lambda r: (
            f"request_id={uuid.UUID(int=r.getrandbits(128), version=4)} status=200 latency_ms={r.randint(3, 900)}"
        ),
    ],
    "git_sha": [
        lambda r: (
            f"$ git log --oneline -3\n{_s(r, HEX, 7)} Fix flaky test\n{_s(r, HEX, 7)} Bump deps\n"
            f"{_s(r, HEX, 7)} Initial"
        ),
        lambda r: f"HEAD is now at {_s(r, HEX, 40)} Merge pull request #{r.randint(10, 999)} from acme/feature",
    ],
    "sha256": [
        lambda r: f"$ sha256sum dist/app.tar.gz\n{_s(r, HEX, 64)}  dist/app.tar.gz",
        lambda r: f"Digest: sha256:{_s(r, HEX, 64)}\nStatus: Downloaded newer image for python:3.12-slim",
        lambda r: f"--hash=sha256:{_s(r, HEX, 64)} \\\n    --hash=sha256:{_s(r, HEX, 64)}",
    ],
    "base64_image": [
        lambda r: f"![screenshot](data:image/png;base64,{_png_b64(r)})",
        lambda r: f'{{"b64_json": "{_png_b64(r)}", "revised_prompt": "a cat"}}',
    ],
    "version": [
        lambda r: (
            f"$ pip list | grep torch\ntorch {r.randint(1, 2)}.{r.randint(0, 13)}.{r.randint(0, 9)}+cpu\n"
            f"torchvision 0.{r.randint(10, 25)}.{r.randint(0, 3)}"
        ),
        lambda r: (
            f"Upgrading node from v{r.randint(14, 22)}.{r.randint(0, 20)}.{r.randint(0, 9)} to "
            f"v{r.randint(18, 24)}.{r.randint(0, 20)}.{r.randint(0, 9)}; build {r.randint(1, 9)}.{r.randint(0, 9)}."
            f"{r.randint(0, 99)}.{r.randint(0, 9999)}"
        ),
        lambda r: (
            f"requires numpy>={r.randint(1, 2)}.{r.randint(0, 26)}.{r.randint(0, 5)},<3 and "
            f"protobuf=={r.randint(3, 5)}.{r.randint(20, 29)}.{r.randint(0, 9)}"
        ),
    ],
    "identifiers": [
        lambda r: f"kubectl get pods\nweb-{_s(r, HEX, 10)}-{_s(r, 'bcdfghjklmnpqrstvwxz2456789', 5)}   1/1   Running",
        lambda r: f"dist/assets/index-{_s(r, ALNUM, 8)}.js   142.31 kB │ gzip: 45.87 kB",
        lambda r: f"def test_parse_config_with_nested_overrides_and_defaults_{r.randint(1, 99)}(tmp_path):",
        lambda r: f"npm notice integrity: sha512-{_s(r, B64, 86)}==",
        lambda r: f"container {_s(r, HEX, 64)} exited with code {r.randint(0, 2)}",
        lambda r: f"const ButtonPrimaryLargeWithIcon = styled.button`color: #{_s(r, HEX, 6)}`;",
        lambda r: (
            f"/home/user/projects/metaclaw/src/metaclaw/privacy/detect.py:{r.randint(1, 300)}: E501 line too long"
        ),
        lambda r: f"Order ORD-{r.randint(100000, 999999)} shipped, tracking 1Z{_s(r, UPPER_NUM, 16)}",
        lambda r: f"s3://acme-build-artifacts/releases/{r.randint(2020, 2026)}/{_s(r, HEX, 12)}/bundle.zip",
        lambda r: f"password_hash = bcrypt.hashpw(password.encode(), bcrypt.gensalt())  # line {r.randint(1, 99)}",
        lambda r: 'API_KEY = os.environ["API_KEY"]\nTOKEN = os.getenv("GITHUB_TOKEN")',
        lambda r: (
            f"$ cat .env.example\nOPENAI_API_KEY=<your-key-here>\nDATABASE_URL=postgres://user:password@localhost/db"
            f"\nPORT={r.randint(3000, 9000)}"
        ),
        lambda r: (
            f"Server listening on http://127.0.0.1:{r.randint(3000, 9000)} and 192.168.{r.randint(0, 255)}."
            f"{r.randint(1, 254)}"
        ),
        lambda r: f"Timestamp {r.randint(1600000000, 1800000000)} (epoch ms {r.randint(10**12, 2 * 10**12)})",
        lambda r: (
            f"Build #{r.randint(1000, 99999)} finished in {r.randint(1, 59)}m{r.randint(0, 59)}s, "
            f"artifact size {r.randint(10**6, 10**9)} bytes"
        ),
    ],
    "secret_words_in_code": [
        lambda r: 'token = request.headers.get("Authorization", "").removeprefix("Bearer ")',
        lambda r: (
            'class Settings(BaseSettings):\n    api_key: str = Field(..., env="API_KEY")\n    timeout_s: float = 30.0'
        ),
        lambda r: 'curl -H "Authorization: Bearer $TOKEN" https://api.internal/v1/health',
        lambda r: (
            "env:\n  - name: DB_PASSWORD\n    valueFrom:\n      secretKeyRef:\n        name: app-db-secret\n"
            "        key: password"
        ),
        lambda r: f"secret_name: prod-tls-{r.randint(1, 9)}\ntoken_ttl_seconds: {r.randint(60, 86400)}",
        lambda r: "if not verify_password(password, user.password_hash):\n    raise HTTPException(401)",
        lambda r: (
            f"$ echo {base64.b64encode(r.choice([b'hello world', b'deploy finished', b'ok'])).decode()} | base64 -d"
        ),
        lambda r: "password: ${POSTGRES_PASSWORD}\nuser: ${POSTGRES_USER}",
        lambda r: f"[INFO] refreshed access token for user {r.randint(100, 9999)} (expires in 3600 s)",
        lambda r: "def rotate_api_key(self, key_id: str) -> ApiKey:\n    return self.client.keys.rotate(key_id)",
    ],
}


def clean(seed: int = 1, n: int = 240) -> list[Item]:
    """`n` clean turns (kinds taken in turn, shapes in turn within a kind): nothing in them may be flagged."""
    r = random.Random(seed)
    kinds = list(CLEAN)
    out = []
    for i in range(n):
        kind = kinds[i % len(kinds)]
        makers = CLEAN[kind]
        out.append(Item("clean", kind, makers[(i // len(kinds)) % len(makers)](r)))
    return out
