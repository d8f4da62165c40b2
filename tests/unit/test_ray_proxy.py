"""RayProxy (asyncrl/deploy/actors.py): the Controller's and the roles' view of a role actor. No Ray needed: a fake
handle records what `.remote` is given and returns an awaitable, as an ObjectRef is."""

import asyncio

from asyncrl.deploy.actors import RayProxy


class Ref:
    def __init__(self, value):
        self.value = value

    def __await__(self):
        yield from asyncio.sleep(0).__await__()
        return self.value


class Method:
    def __init__(self, log):
        self.log = log

    def remote(self, *args, **kwargs):
        self.log.append((args, kwargs))
        return Ref(len(self.log))


class Handle:
    def __init__(self):
        self.log = []
        self.call = Method(self.log)
        self.call_hosted = Method(self.log)


def test_a_call_is_submitted_when_made_not_when_awaited():
    handle = Handle()
    proxy = RayProxy(handle)
    first = proxy.note_held(3, holder="generator/0")
    second = proxy.stats()
    assert handle.log == [(("note_held", 3), {"holder": "generator/0"}), (("stats",), {})]  # both left, in order

    async def main():
        return await asyncio.gather(second, first)  # awaited in any order, gathered like futures

    assert asyncio.run(main()) == [2, 1]


def test_a_hosted_role_is_routed_through_call_hosted():
    handle = Handle()
    asyncio.run(_await(RayProxy(handle, "scorer", 1).stats()))
    assert handle.log == [(("scorer", 1, "stats"), {})]


async def _await(aw):
    return await aw
