// jsdom has no Clipboard API; @jupyterlab/apputils warns about it on import. Give it one.
if (!navigator.clipboard) {
  const items = [];
  Object.defineProperty(navigator, 'clipboard', {
    configurable: true,
    value: {
      read: async () => items,
      readText: async () => '',
      write: async data => {
        items.splice(0, items.length, ...data);
      },
      writeText: async () => undefined
    }
  });
}
