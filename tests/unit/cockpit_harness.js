// Runs packaging/cockpit/hostd.js in node with stand-ins for the browser and
// cockpit.js, opens the model view for the name in argv[3] (as the URL
// #/NAME does) and prints every cockpit.spawn argv as one JSON line.
// tests/unit/test_cockpit_page.py drives it.
"use strict";
const fs = require("fs");
const vm = require("vm");

const spawned = [];
// Anything a page may touch on an element or a D-Bus proxy: itself, callable.
const anything = new Proxy(function () {}, {
    get: (target, key) => key === "then" ? undefined : key === Symbol.toPrimitive ? () => "" : anything,
    apply: () => anything,
    set: () => true,
});
const settled = value => Promise.resolve(value);
const process_ = () => {
    const promise = new Promise(() => {});
    promise.stream = () => promise;
    promise.close = () => {};
    return promise;
};
let onLocation = null;
const cockpit = {
    dbus: () => ({
        call: () => settled([{}]),
        subscribe: () => ({ remove() {} }),
        proxy: () => anything,
        watch: () => settled(),
        wait: fn => fn && fn(),
    }),
    spawn: argv => { spawned.push(argv); return process_(); },
    location: { path: [], go() {} },
    addEventListener: (event, fn) => { if (event === "locationchanged") onLocation = fn; },
    transport: { wait() {} },
    format: () => "",
};
const context = vm.createContext({
    cockpit, document: anything, window: anything, CSS: { escape: s => s }, TextDecoder, console,
    setTimeout: () => 0, clearTimeout() {}, setInterval: () => 0, clearInterval() {}, Date, JSON, Promise,
});
vm.runInContext(fs.readFileSync(process.argv[2], "utf8"), context, { filename: "hostd.js" });
cockpit.location.path = [encodeURIComponent(process.argv[3])];
setImmediate(() => {
    if (onLocation) onLocation();
    setImmediate(() => console.log(JSON.stringify(spawned)));
});
