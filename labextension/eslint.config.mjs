import js from '@eslint/js';
import jupyterPlugin from '@jupyter/eslint-plugin';
import prettierRecommended from 'eslint-plugin-prettier/recommended';
import { defineConfig } from 'eslint/config';
import globals from 'globals';
import tseslint from 'typescript-eslint';

export default defineConfig([
  {
    ignores: [
      'node_modules',
      'lib',
      'coverage',
      'gpupool_lab',
      '.yarn-cache',
      '**/*.js',
      '**/*.d.ts',
      'ui-tests'
    ]
  },
  js.configs.recommended,
  tseslint.configs.recommended,
  jupyterPlugin.configs.recommended,
  {
    files: ['**/*.ts', '**/*.tsx', '**/*.mjs'],
    languageOptions: {
      globals: {
        ...globals.browser,
        ...globals.es2021,
        ...globals.node
      },
      sourceType: 'module'
    },
    rules: {
      '@typescript-eslint/naming-convention': [
        'error',
        {
          selector: 'interface',
          format: ['PascalCase'],
          custom: {
            regex: '^I[A-Z]',
            match: true
          }
        }
      ],
      '@typescript-eslint/no-unused-vars': ['warn', { args: 'none' }],
      '@typescript-eslint/no-explicit-any': 'off',
      '@typescript-eslint/no-namespace': 'off',
      '@typescript-eslint/no-use-before-define': 'off',
      // The jobs panel and the status item must exist when the application starts (a sidebar
      // tab, a status bar item); everything else is imported where it is first used.
      'jupyter/prefer-lazy-imports': ['warn', { ignoreImports: ['./jobs', './status'] }],
      curly: ['error', 'all'],
      eqeqeq: 'error',
      'prefer-arrow-callback': 'error'
    }
  },
  {
    files: ['src/__tests__/**/*.ts'],
    languageOptions: { globals: { ...globals.jest } },
    rules: {
      // Test data is not user-facing text.
      'jupyter/no-untranslated-string': 'off'
    }
  },
  prettierRecommended
]);
