"""Chat templates under a budget: the same text as transformers for real templates, and a 400 within the
budget (not minutes, not gigabytes) for hostile ones."""

from __future__ import annotations

import resource
import time

import pytest
from keel_io_processors.chat import ChatProcessor
from keel_io_processors.protocol import InvalidRequestError
from keel_io_processors.template import TemplateBudgetError, render_chat_template

from keel.io import RequestLimits
from keel.testing.tokenizer import build_tokenizer

LIMITS = RequestLimits(trust_request_chat_template=True, chat_template_timeout_s=0.5,
                       chat_template_max_chars=1 << 20)

# Templates shaped like the Hub's: loops, namespaces, macros, filters, tojson, raise_exception, slicing.
TEMPLATES = [
    None,  # the test tokenizer's own ChatML template
    ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}<<SYS>>{{ m['content'] | trim }}"
     "<</SYS>>{% else %}[{{ m['role'] | upper }}] {{ m['content'] }}{% endif %}{% endfor %}"
     "{% if add_generation_prompt %}[ASSISTANT]{% endif %}"),
    ("{% set ns = namespace(n=0, last='') %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
     "{% set ns.last = m.content ~ '|' ~ loop.index %}{{ m.role ~ ':' ~ m.content }}\n{% endfor %}"
     "{{ ns.n }}{{ ns.last }}{{ messages | map(attribute='role') | join(',') }}{{ messages[-1] | tojson }}"
     "{% if messages | length > 9 %}{{ raise_exception('too many') }}{% endif %}"),
    ("{% macro render(m) %}<{{ m.role }}>{{ m.content | replace('a', 'A') | center(30) }}</{{ m.role }}>"
     "{% endmacro %}{% for m in messages[1:] %}{{ render(m) }}{% generation %}{{ '%s-%d' % (m.role, 3) }}"
     "{% endgeneration %}{% endfor %}{{ '{:>5}'.format('x') }}{{ 'y' * 3 }}{{ 2 ** 10 }}{{ extra_var }}"),
]
MESSAGES = [{"role": "system", "content": " be brief "}, {"role": "user", "content": "a cat", "name": "ann"},
            {"role": "assistant", "content": "a dog"}, {"role": "user", "content": "and a bat?"}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.mark.parametrize("template", TEMPLATES)
@pytest.mark.parametrize("add_generation_prompt, continue_final", [(True, False), (False, False), (False, True)])
def test_renders_exactly_as_transformers(tokenizer, template, add_generation_prompt, continue_final):
    if continue_final and template is not None and "content }}" not in template:
        pytest.skip("the template does not render content verbatim")
    kwargs = {"extra_var": "!"}
    expected = tokenizer.apply_chat_template(MESSAGES, chat_template=template, tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final, **kwargs)
    source = tokenizer.get_chat_template(template)
    got = render_chat_template(source, MESSAGES, add_generation_prompt=add_generation_prompt,
                               continue_final_message=continue_final,
                               variables={**tokenizer.special_tokens_map, **kwargs}, limits=LIMITS)
    assert got == expected


def _hostile(source: str) -> tuple[float, int]:
    """Seconds until refused, and the growth of the process's peak RSS (KiB)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.monotonic()
    with pytest.raises(TemplateBudgetError):
        render_chat_template(source, MESSAGES, add_generation_prompt=True, continue_final_message=False,
                             variables={}, limits=LIMITS)
    return time.monotonic() - t0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak


@pytest.mark.parametrize("source", [
    # time: ~1e10 steps, with and without calls in the inner loop
    "{% set r = range(100000) %}{% for i in r %}{% for j in r %}{% endfor %}{% endfor %}",
    "{% for i in range(100000) %}{% for j in range(100000) %}{{ j if false }}{% endfor %}{% endfor %}",
    "{% macro f(n) %}{% for i in range(100000) %}{% endfor %}{{ f(n) }}{% endmacro %}{{ f(1) }}",
])
def test_long_loops_stop_at_the_deadline(source):
    elapsed, _ = _hostile(source)
    assert elapsed < LIMITS.chat_template_timeout_s + 1.0


@pytest.mark.parametrize("source", [
    "{% set s = 'x' * 10**9 %}",
    "{{ 'x' * 1000000000 }}",
    "{{ [1] * 10**9 }}",
    "{{ 10 ** (10 ** 8) }}",  # Jinja groups ** from the left
    "{{ 'x' | center(10**9) }}",
    "{{ 'x'.ljust(10**9) }}",
    "{{ '{:>1000000000}'.format(1) }}",
    "{{ '%01000000000d' % 1 }}",
    "{{ 'x' | indent(10**9, true) }}",
    "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "{% set s = 'x' * 1000000 %}{{ range(100000) | join(s) }}",
    "{% set s = 'x' * 1000000 %}{{ s.join(range(100000) | map('string')) }}",
    "{% set s = 'x' * 100000 %}{{ s.replace('x', s) }}",
    "{% for i in range(100000) %}{{ 'y' * 100000 }}{% endfor %}",  # output past the budget
    "{% macro f(s) %}{{ f(s ~ s) }}{% endmacro %}{{ f('x') }}",
])
def test_growing_values_are_refused_before_they_are_built(source):
    elapsed, grown_kib = _hostile(source)
    assert elapsed < LIMITS.chat_template_timeout_s + 1.0
    assert grown_kib < 200 * 1024  # the budget is 1 Mi characters; nothing near a gigabyte


def test_the_sandbox_still_holds():
    import jinja2

    def render(source):
        return render_chat_template(source, MESSAGES, add_generation_prompt=True, continue_final_message=False,
                                    variables={}, limits=LIMITS)

    for escape in ("{{ ''.__class__.__mro__ }}", "{{ messages.__class__ }}", "{{ cycler.__init__.__globals__ }}",
                   "{% set x = messages.append(1) %}", "{% set ns = namespace(_x=1) %}",
                   "{{ ''.__class__.__mro__[1].__subclasses__() }}", "{{ lipsum.__globals__ }}"):
        try:
            out = render(escape)
        except jinja2.exceptions.SecurityError:
            continue
        assert "class" not in out and "function" not in out and "module" not in out, escape


def test_processor_turns_budget_and_template_errors_into_400(tokenizer):
    proc = ChatProcessor(tokenizer=tokenizer, served_model_name="m", limits=LIMITS)
    for template, param in (("{{ 'x' * 10**9 }}", "messages"), ("{% for %}", "messages"),
                            ("{{ ''.__class__.__mro__ }}", "messages")):
        req = proc.parse_request({"messages": MESSAGES, "chat_template": template})
        with pytest.raises(InvalidRequestError) as err:
            proc.pre_process(req)
        assert err.value.param == param
    with pytest.raises(InvalidRequestError) as err:
        proc.pre_process(proc.parse_request({"messages": MESSAGES, "chat_template_kwargs": {"messages": []}}))
    assert err.value.param == "chat_template_kwargs"
