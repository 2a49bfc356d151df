import { LabIcon } from '@jupyterlab/ui-components';

const gpuSvg = `<svg xmlns="http://www.w3.org/2000/svg" width="16" height="16" viewBox="0 0 24 24">
  <g class="jp-icon3" fill="#616161">
    <path d="M6 6h12a2 2 0 0 1 2 2v8a2 2 0 0 1-2 2H6a2 2 0 0 1-2-2V8a2 2 0 0 1 2-2zm0 2v8h12V8H6z"/>
    <path d="M8 10h8v4H8zM7 2h2v3H7zm4 0h2v3h-2zm4 0h2v3h-2zM7 19h2v3H7zm4 0h2v3h-2zm4 0h2v3h-2zM1 9h2v2H1zm0 4h2v2H1zm20-4h2v2h-2zm0 4h2v2h-2z"/>
  </g>
</svg>`;

/**
 * A GPU chip, themed through the `jp-icon3` class.
 */
export const gpuIcon = new LabIcon({ name: 'gpupool-lab:gpu', svgstr: gpuSvg });
